# The two commands of the README. Both start from nothing but python3, pip and a C++ compiler.
PYTHON ?= python3
# Pinned CPU build by default; override for another build, e.g. make test TORCH="torch==2.13.0+cu128"
TORCH ?= torch==2.13.0
VENV ?= .venv
OUT ?= out
PY := $(VENV)/bin/python
DYN := $(VENV)/bin/dynplugin

.PHONY: install demo test clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.deps: setup.py pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

# Rebuild the C++ extension whenever csrc/ changes (an editable install does not).
$(VENV)/.ext: $(wildcard csrc/*.cpp csrc/*.hpp) $(VENV)/.deps
	$(PY) setup.py -q build_ext --inplace
	touch $@

install: $(VENV)/.ext

test: install
	$(PY) -m pytest -q

demo: install
	@mkdir -p $(OUT)
	$(DYN) report
	$(DYN) lengths code --out $(OUT)/code.npy
	$(DYN) analyze $(OUT)/code.npy --plot $(OUT)/code-analysis.png
	$(DYN) profile --model tiny-llama --threads 1 --recompute none,full --out $(OUT)/profile.json
	@echo
	@echo "demo outputs in $(OUT)/: code.npy (lengths), code-analysis.png (padding/packing waste), profile.json (fitted costs)"

clean:
	rm -rf $(VENV) build *.egg-info dyn_plugin/_core*.so $(OUT)
