# Two commands do everything on a fresh machine: `make demo` and `make test`.
PY      := .venv/bin/python
RUN     := launch/mpiscale-run
RANKS   ?= 4

.PHONY: setup demo test lint bench

setup:
	@bash launch/setup.sh

demo: setup
	$(RUN) -n $(RANKS) --ranks-per-node 2 -- .venv/bin/mpiscale demo

lint: setup
	.venv/bin/ruff check mpiscale tests examples

test: setup lint
	$(PY) -m pytest

bench: setup
	$(RUN) -n 2 -- .venv/bin/mpiscale bench pingpong --json bench-pingpong.json
