# The two commands of the README. Both start from nothing but python3, pip and a C++ compiler.
PYTHON ?= python3
# Pinned CPU build by default; override for another build, e.g. make test TORCH="torch==2.13.0+cu128"
TORCH ?= torch==2.13.0
VENV ?= .venv
OUT ?= out
PY := $(VENV)/bin/python
DYN := $(VENV)/bin/dynplugin

.PHONY: install demo test test-slow lint format lock clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# constraints.txt: the versions the suite was tested with, so a fresh install next month installs the same
$(VENV)/.deps: setup.py pyproject.toml constraints.txt | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	touch $@

# Rebuild the C++ extension whenever csrc/ changes (an editable install does not).
$(VENV)/.ext: $(wildcard csrc/*.cpp csrc/*.hpp) $(VENV)/.deps
	$(PY) setup.py -q build_ext --inplace --force  # a changed header alone would not rebuild it
	touch $@

install: $(VENV)/.ext

# DYN_PLUGIN_REQUIRE_NATIVE: a C++ extension that did not build fails the tests instead of skipping them
# `make test` leaves out tests marked slow (pyproject addopts); this runs only those
# --durations=25: the 25 slowest tests listed at the end (in CI's log too: .ci/run runs this target)
test: install lint
	DYN_PLUGIN_REQUIRE_NATIVE=1 $(PY) -m pytest -q --durations=25

# the formatter and linter (pyproject [tool.ruff]); `make format` rewrites, `make lint` only checks
lint: install
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# re-pin constraints.txt to what the virtualenv holds now (after upgrading on purpose)
lock: install
	{ sed -n '1,3p' constraints.txt; $(PY) -m pip freeze --exclude-editable | grep -v '^torch=='; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

test-slow: install
	$(PY) -m pytest -q -s -m slow

demo: install
	@mkdir -p $(OUT)
	$(DYN) report
	$(DYN) lengths code --out $(OUT)/code.npy
	$(DYN) analyze $(OUT)/code.npy --plot $(OUT)/code-analysis.png
	$(DYN) profile --model tiny-llama --threads 1 --ranks 2 --recompute none --seq-lens 16,64,256,1024,4096 --micro-batch-sizes 1,2,4,16 --max-tokens 4096 --repeats 3 --validate 8 --out $(OUT)/profile.json
	$(DYN) plan --config examples/a100_gpt67b.json --lengths code --steps 3 --trace $(OUT)/plan-trace.json --plot $(OUT)/plan.png --plans $(OUT)/plans
	$(DYN) plan --config examples/a100_gpt67b_sp.json --lengths code --global-tokens 65536 --dp 4 --steps 1
	$(DYN) shard --model examples/gpt-6.7b.json --config examples/a100_gpt67b_shard.json --out $(OUT)/shard-plan.json --plot $(OUT)/shard-frontier.png
	$(DYN) strategy code --gpus 64 --model gpt-6.7b --out $(OUT)/strategy.json --plot $(OUT)/strategy.png
	$(DYN) bench train --profile $(OUT)/profile.json --out $(OUT)/train
	$(VENV)/bin/torchrun --nproc_per_node=2 examples/deepspeed_llama/train.py --profile $(OUT)/profile.json --data $(OUT)/train --steps 2
	$(VENV)/bin/torchrun --nproc_per_node=2 examples/hf_trainer/train.py --data $(OUT)/train --out $(OUT)/hf-trainer --steps 3
	$(DYN) megatron --dyn-plugin-config examples/megatron_gpt/cfg.json --nproc-per-node 2 -- examples/megatron_gpt/train.py --data $(OUT)/megatron-data --steps 3 --records $(OUT)/megatron-steps.jsonl
	@echo
	@echo "demo outputs in $(OUT)/:"
	@echo "  code.npy, code-analysis.png   real code lengths; what padding and packing waste on them"
	@echo "  profile.json                  tiny Llama measured on this CPU, fitted cost model"
	@echo "  plan.png, plan-trace.json     A100 GPT-6.7B plans vs baselines; open the trace in https://ui.perfetto.dev"
	@echo "  plans/rank*.json              per-rank execution plans (instructions) of the first step"
	@echo "  (printed)                     sequence parallelism per micro-batch: dynamic vs fixed sizes, Megatron's hybrid CP, DCP's buckets"
	@echo "  shard-plan.json, shard-frontier.png  GPT-6.7B on 2 A100 nodes: a sharding choice per module under 32 GB (OSDP)"
	@echo "  strategy.json, strategy.png   GPT-6.7B on 64 A100s: heterogeneous strategies proposed for code lengths (Hydraulis)"
	@echo "  train/report.md, report.png   DeepSpeed on 2 CPU ranks: padded, token budget, fixed-length and varlen packing, dyn_plugin"
	@echo "  train/step-trace.json         one executed plugin step, measured vs predicted per micro-batch"
	@echo "  hf-trainer/                   the Hugging Face Trainer (DynPluginTrainer) on the plugin's plans: 3 logged steps"
	@echo "  megatron-steps.jsonl          a megatron-core GPT loop, unchanged, trained on the plugin's plans via one launcher flag"

clean:
	rm -rf $(VENV) build *.egg-info dyn_plugin/_core*.so $(OUT)
