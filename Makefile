# The two commands of the README: `make demo` (the main job) and `make test`; `make docs`
# builds the documentation site into site/ (warnings are errors).
# All of them create .venv on first use and install opttx into it. torch is pinned here (a CPU
# build on our machines); pyproject.toml keeps a range for users. Override with TORCH_SPEC=...
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: demo test bench docs clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test,bench,docs]"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/python -m opttx.bench

# OPTTX_REQUIRE_REFERENCES=1: a reference package of .[test] that does not import fails
# (tests/test_reference_packages.py) instead of letting its comparisons skip.
# TEST_WORKERS pytest-xdist processes, a test file to each (--dist loadfile: a module's
# spawned worlds and compiled graphs are made once); TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: $(VENV)/.installed
	OPTTX_REQUIRE_REFERENCES=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/step_time.py

docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict -d site

clean:
	rm -rf $(VENV) report site .pytest_cache .hypothesis
