# Two commands do everything on a fresh machine: `make demo` and `make test`.
PY      := .venv/bin/python
RUN     := launch/mpiscale-run
RANKS   ?= 4
DEMO    ?= demo-output

.PHONY: setup demo ring test test-slow lint api bench gpu-check

setup:
	@bash launch/setup.sh

# The main job on its embedded default: dictionary learning on a planted data set, then its report and plot.
demo: setup
	@mkdir -p $(DEMO)
	$(RUN) -n $(RANKS) -- .venv/bin/mpiscale dictlearn --atoms 100 --features 32 --samples 6000 --sparsity 4 \
		--snr-db 20 --iterations 600 --eval-every 100 --progress-every 1 --out $(DEMO)/results.h5
	.venv/bin/mpiscale inspect $(DEMO)/results.h5 --plot $(DEMO)/results.png

# The runtime's own demo: actors pass tokens round a ring on 2 simulated nodes, then an allreduce.
ring: setup
	$(RUN) -n $(RANKS) --ranks-per-node 2 -- .venv/bin/mpiscale demo

# Style, the import contracts of setup.cfg ([importlinter]: docs/architecture.md, "Where new code goes"), types,
# and the API reference built without a warning (into a scratch folder: make api writes docs/api/).
lint: setup
	.venv/bin/ruff check mpiscale tests examples docs/build_api.py
	.venv/bin/ruff format --check mpiscale tests examples docs/build_api.py
	.venv/bin/lint-imports
	.venv/bin/mypy mpiscale
	$(PY) docs/build_api.py $$(mktemp -d)

# The API reference, from the docstrings of the public modules: docs/api/index.html.
api: setup
	$(PY) docs/build_api.py docs/api

# The tests run on TEST_WORKERS pytest-xdist workers: one by one, half of the suite's time is waiting (mpirun's grace
# periods, sleeps, Slurm's scheduling), which the other workers fill. On 2026-11-26 three were slower than two on this
# 2-core machine (17:48 against 15:16-16:32, the CPU saturated) and made two timing tests miss. Since then the ranks
# start warm and the tests wait less in CPU; on 2026-12-07 (a slower VM) two workers left the cores 8% idle over a run
# (18% in parts), three 7%, and clean clones took 26:22 of pytest on two workers, 22:33 and 26:06 on three, every test
# passing (the VM's pace varies by 15% between runs of the same code: a small gain, not a sure one). Most of the CPU is
# the ranks' start-up (torch's import: 1.2-1.9 s of a training rank; Numba's import and target: 0.8 s of any other), so
# a rank the tests launch starts warm, forked from a process of its worker that has imported them already
# (tests/warm_start.py; docs/architecture.md, "How the tests run"; MPISCALE_TESTS_COLD=1 starts every rank cold, as a
# user's job does: 19-20 minutes that day). Set-up compiles the Numba kernels once, and the library-level checks of a
# module share one MPI world per layout (tests/helpers.py, Worlds). A file's tests stay on one worker: they share
# fixtures (a trained model, the Slurm cluster, which a second one on the host would fight). TEST_WORKERS=0 runs them in
# this process, one after another. On 2026-12-02 a clean clone's pytest took 24:09 (2,866 s of the workers' time for
# 1,450 s of wall: they ran side by side to the end); process accounting over the dictlearn and circuits files found the
# two cores 87% busy, 84% of it in warm-started ranks' own work, and the runtime's spins cost nothing there (all spins
# off: 204 s, 207 on). On 2026-12-03, with the project's bytecode and more preloaded in the warm ranks, a clean clone's
# pytest took 21:41 on a fast hour of the VM and 33:08 on a slow one (2,621 s of the workers' time in the fast run; the
# cores 85% busy over its whole .ci/run); the cold-started cluster file was the largest, 371 s. On 2026-12-04, its ranks
# warm too, a clean clone's pytest took 20:00 (2,416 s of the workers' time; the cluster file 303 s; other files ran
# 5-20% faster too that hour, so part of it is the VM's speed). On 2026-12-06 a warm rank's end left out the
# interpreter's teardown of the preloaded modules (about 0.3 s a rank, tests/warm_start.py): the user-data and circuits
# files took 107-112 s against 122-125 s, old and new alternating; a clean clone's pytest took 19:36 (2,388 s of the
# workers' time) against 24:16 (2,877 s) an hour before, the rest of it the VM's pace.
TEST_WORKERS ?= 3

# The suite runs on the compiled message path (launch/setup.sh builds it; tests/unit/test_wire.py fails where it is
# missing or stale); the runtime's message tests then run again on the pure-Python reference (MPISCALE_PURE_PYTHON=1).
PURE_PATH_TESTS := tests/unit/test_transport.py tests/unit/test_inline_handlers.py tests/mpi/test_messaging.py \
	tests/mpi/test_channels.py \
	tests/mpi/test_errors.py::test_remote_errors_deadlines_supervision

test: setup lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile
	MPISCALE_PURE_PYTHON=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -p no:cacheprovider $(PURE_PATH_TESTS)

# The tests make test leaves out: a real Slurm time limit and its requeue (about four minutes), the requeue of an
# mpirun launcher line (make test requeues an srun line, and stops and resumes an mpirun one), and on the local
# multi-node cluster the train run that loses a node and the mpirun line inside a 2-node allocation (make test runs
# dictlearn's and srun's, keeping the node-level tests within four minutes)
test-slow: setup
	$(PY) -m pytest -m slow

bench: setup
	$(RUN) -n 2 -- .venv/bin/mpiscale bench pingpong --json bench-pingpong.json

# On a machine with an NVIDIA GPU: the CUDA tests on the real device (they fail, not skip, without one), then the GPU
# columns of the OMP, dictionary-learning, memory-store, adapter and DDP benchmarks; --device cuda end to end for
# collect, compress-adapters, data-parallel and pipeline train and circuits run. One script (launch/gpu-check.sh),
# which also runs on a GPU machine without network with its own python3 (docs/hpc.md, "Checking the GPU paths").
gpu-check: setup
	bash launch/gpu-check.sh
