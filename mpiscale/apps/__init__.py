"""Small demos of the runtime (the token ring of ``mpiscale demo``); each workload has a package of its own."""
