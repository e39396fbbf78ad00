# mcit: `make demo` runs the main job on the embedded default, `make test` runs the tests.
# Both create .venv and install the project first (CPU torch wheel; nothing is downloaded at run time).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
NPROC  ?= 2
DEMO_CONFIGS ?= configs/tiny_mcit_prompt_tuning.yaml configs/tiny_mcit_fwd_prompt.yaml configs/tiny_mcit_lora.yaml \
                configs/tiny_mcit_olora.yaml configs/tiny_mcit_moelora.yaml configs/tiny_mcit_multitask.yaml
# The other MCIT methods (`make demo-more`: HiDe-LLaVA and DISCO route with the tiny CLIP of `make data-cil`)
MORE_CONFIGS ?= configs/tiny_mcit_modal_prompt.yaml configs/tiny_mcit_cl_moe.yaml configs/tiny_mcit_sefe.yaml \
                configs/tiny_mcit_hide_llava.yaml configs/tiny_mcit_disco.yaml configs/tiny_mcit_replay.yaml \
                configs/tiny_mcit_ewc.yaml configs/tiny_mcit_lwf.yaml
CIL_METHODS  ?= seq l2p l2p_pgp dualprompt dualprompt_pgp coda_prompt hide_prompt norga vpt_nsp2 soft_tf soft_tf_gradient_id soft_tf_gradient_id_batch l2p_soft_tf clip_zero_shot vpt_nsp2_clip star_prompt
CIL_CONFIGS  ?= $(foreach m,$(CIL_METHODS),configs/digits_$(m).yaml)
DATA_ENV := DS_ACCELERATOR=cpu
RUN := PATH=$(abspath $(BIN)):$$PATH DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1

.PHONY: install install-test data data-cil demo demo-more demo-cil study-cil study-mcit instrument-mcit instrument-cil sweep-demo lint test test-unit test-numerics mutate bench clean clean-data

# `install` is what the runs need; `install-test` adds the test tools and lmms-eval's run-time needs (the demo
# does not wait for them).
install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -qq --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -qq --disable-pip-version-check -e . torch==2.13.0
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/python -m mcit.core.extensions --ops ShareMemCommBuilder  # DeepSpeed's all-reduce op, built now, not at a run's start
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	$(BIN)/pip install -qq --disable-pip-version-check -e ".[test,lmms,trackers]" torch==2.13.0
	$(BIN)/pip install -qq --disable-pip-version-check --no-deps lmms-eval==0.7.3
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/python -m mcit.core.extensions --ops CPUAdamBuilder  # ZeRO-offload's (tests run it)
	# headless Chromium for the report.html tests (Debian's packages; selenium drives it, nothing downloaded later)
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium chromium-driver >/dev/null; }
	touch $@

# Data and backbones are file targets: each is rebuilt only when the code that determines its bytes is newer
# than it (make then passes --force, so the builder does not keep an older build with the same settings).
# The venv is order-only: after upgrading packages, `make clean-data` to rebuild with the new versions.
DIGITS     := data/shards/digits/benchmark.json
TINY_VIT   := data/backbones/tiny_vit_procedural/pretraining.json
TINY_CLIP  := data/backbones/tiny_clip_procedural/pretraining.json
TINY_MCIT  := data/shards/tiny_mcit/benchmark.json
TINY_LLAVA := data/backbones/tiny_llava/pretraining.json

$(DIGITS): data_prep/digits.py mcit/data/shards.py | $(VENV)/.installed
	$(DATA_ENV) $(BIN)/python -m data_prep.digits --out $(@D) --force

$(TINY_VIT): data_prep/pretrain_vit.py data_prep/common.py mcit/data/procedural.py | $(VENV)/.installed
	$(DATA_ENV) $(BIN)/python -m data_prep.pretrain_vit --out $(@D) --force

$(TINY_CLIP): data_prep/pretrain_clip.py data_prep/common.py mcit/data/procedural.py | $(VENV)/.installed
	$(DATA_ENV) $(BIN)/python -m data_prep.pretrain_clip --out $(@D) --force

$(TINY_MCIT): data_prep/tiny_mcit.py mcit/data/tiny_mcit.py mcit/data/instructions.py mcit/data/shards.py | $(VENV)/.installed
	$(DATA_ENV) $(BIN)/python -m data_prep.tiny_mcit --out $(@D) --force

$(TINY_LLAVA): data_prep/pretrain_tiny_llava.py data_prep/common.py mcit/models/tiny_llava.py mcit/models/mllm.py mcit/models/llava.py \
               mcit/data/tiny_mcit.py \
               $(TINY_MCIT) | $(VENV)/.installed
	$(DATA_ENV) $(BIN)/python -m data_prep.pretrain_tiny_llava --shards $(dir $(TINY_MCIT)) --out $(@D) --force

# The embedded MCIT benchmark's shards and the project's own instruction-tuned tiny LLaVA.
data: $(TINY_MCIT) $(TINY_LLAVA)

# The main job: the MCIT sequence on 2 CPU processes with sequential prompt tuning, Fwd-Prompt, sequential
# LoRA, O-LoRA, MoELoRA and the multi-task bound (LoRA on all tasks at once), then one comparison table whose
# first column is the pre-trained backbone itself (the zero-shot row of the LoRA run). One launch runs the six
# sequences one after another (one launcher start); re-running it skips the finished ones and resumes the rest.
# Six methods: with more it no longer fits ten minutes on a fresh clone here.
demo: data
	$(RUN) deepspeed --log_level=error --num_gpus $(NPROC) pipelines/run_task_sequence.py $(foreach c,$(DEMO_CONFIGS),--config $(c))
	$(BIN)/python -m mcit.cli.report --zero-shot-of runs/tiny_mcit_lora $(foreach c,$(DEMO_CONFIGS),runs/$(basename $(notdir $(c))))

# The rest of the MCIT methods on the embedded default (after `make demo`), then one table of every MCIT run.
demo-more: data data-cil
	$(RUN) deepspeed --log_level=error --num_gpus $(NPROC) pipelines/run_task_sequence.py $(foreach c,$(MORE_CONFIGS),--config $(c))
	$(BIN)/python -m mcit.cli.report --zero-shot-of runs/tiny_mcit_lora \
	  $(foreach c,$(DEMO_CONFIGS) $(MORE_CONFIGS),runs/$(basename $(notdir $(c))))

# The MCIT study behind the README's tables (about 35 + 60 minutes here): every demo method's learning rate and
# Fwd-Prompt's ablations, then every other MCIT method's learning rate (ModalPrompt, CL-MoE, SEFE, HiDe-LLaVA, DISCO,
# Replay, EWC, LwF), 3 seeds each, judged on a validation carve of the training data; then the chosen defaults of
# all of them over 3 seeds on the test split; then the tables and figures (docs/mcit_study.md and
# docs/mcit_study_methods.md, each with its figures docs/<study>_*.png).
MCIT_SELECTION := tiny_mcit_tuning_prompts tiny_mcit_tuning_lora tiny_mcit_fwd_prompt_ablation
MCIT_METHODS_SELECTION := tiny_mcit_tuning_modal_prompt tiny_mcit_tuning_lora_methods tiny_mcit_tuning_classic
study-mcit: data data-cil
	@for s in $(MCIT_SELECTION) $(MCIT_METHODS_SELECTION) tiny_mcit_seeds; do \
	  $(RUN) $(BIN)/python -m pipelines.sweep --spec configs/sweeps/$$s.yaml --nproc $(NPROC) || exit 1; \
	done
	$(BIN)/python -m mcit.cli.study --selection $(foreach s,$(MCIT_SELECTION),runs/sweeps/$(s)) \
	  --final runs/sweeps/tiny_mcit_seeds --out docs/mcit_study
	$(BIN)/python -m mcit.cli.study --selection $(foreach s,$(MCIT_METHODS_SELECTION),runs/sweeps/$(s)) \
	  --final runs/sweeps/tiny_mcit_seeds --out docs/mcit_study_methods

# The class-incremental demo: digits shards, the tiny ViT pre-trained on procedural shapes, every CIL method
# (2 CPU ranks each), then one comparison table.
data-cil: $(DIGITS) $(TINY_VIT) $(TINY_CLIP)

demo-cil: data-cil
	$(RUN) deepspeed --log_level=error --num_gpus $(NPROC) pipelines/run_task_sequence.py $(foreach c,$(CIL_CONFIGS),--config $(c))
	$(BIN)/python -m mcit.cli.report $(foreach c,$(CIL_CONFIGS),runs/$(basename $(notdir $(c))))

# The CIL comparison judged on means: every embedded CIL method over CIL_SEEDS (3 seeds: 48 runs of 2 CPU ranks,
# about 40 minutes here), then mean ± std per method in runs/sweeps/cil_seeds/aggregate.md. One seed alone does
# not rank these methods (their spread over seeds is larger than most gaps between them).
CIL_SEEDS ?= 0 1 2
study-cil: data-cil
	$(RUN) $(BIN)/python -m pipelines.sweep --spec configs/sweeps/cil_seeds.yaml --seeds $(CIL_SEEDS) --nproc $(NPROC)

# The embedded benchmarks as a measuring instrument (bench/instrument.py): every method of the seeds study over 3
# seeds, and its seed 0 under each CPU kernel set this machine emulates (ATen / MKL / oneDNN held to AVX2 and to
# their portable paths), each set on the backbones it pre-trained itself (the same bytes: pre-training pins its
# kernels; --split-source adds runs on the native backbones for builders that do not); the report goes to
# docs/instrument_<benchmark>.md.
instrument-mcit: data data-cil
	$(BIN)/python -m bench.instrument --benchmark mcit --nproc $(NPROC) --doc docs/instrument_mcit.md

instrument-cil: data-cil
	$(BIN)/python -m bench.instrument --benchmark cil --nproc $(NPROC) --doc docs/instrument_cil.md

# A study: VPT-NSP²'s stability-plasticity curve over eta, 3 seeds, on the embedded benchmark (15 runs, each on
# NPROC CPU ranks through the DeepSpeed launcher), then the aggregated table and figures in runs/sweeps/.
SWEEP_ARGS ?= --config configs/digits_vpt_nsp2.yaml --seeds 0 1 2 --grid method.eta=1.0,0.95,0.9,0.85,0.8
sweep-demo: data-cil
	$(RUN) $(BIN)/python -m pipelines.sweep $(SWEEP_ARGS) --nproc $(NPROC)

lint: install-test
	$(BIN)/ruff check --no-cache .

# The quick loop: the in-process tests only (tests/unit; no launchers, no Slurm).
test-unit: install-test
	PATH=$(abspath $(BIN)):$$PATH DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES= $(BIN)/python -m pytest -q -m unit tests

# The linter first (ruff, settings in pyproject.toml), then two pytest workers, each test file whole on one of
# them (module fixtures such as the Slurm cluster are built once): most tests wait on launched processes, so
# this is ~35% faster on 2 cores.
test: install-test
	$(BIN)/ruff check --no-cache .
	PATH=$(abspath $(BIN)):$$PATH DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES= $(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests

# The number-comparing tests (tests/reference and the in-process tests marked `numerics`) once per CPU kernel set
# this machine can emulate: MKL held to SSE4.2 / AVX2 / AVX-512 (1 and 2 threads) and to its reproducible path,
# ATen's default and AVX2 kernels, oneDNN capped at AVX2. Then each fixture's noise floor against its tolerance
# (margin >= 10), and every wrong variant of tests/reference/variants/ against the tests (each must fail, >= 10
# tolerances away). What `make test` cannot show on one machine: that a tolerance holds on CPUs you do not have.
# Not part of `make test`: about an hour here (25 min for the 12 kernel sets, 33 min for the 280 variants).
# NUMERICS_ARGS: e.g. --kernels default aten_default.
NUMERICS_ARGS ?=
test-numerics: install-test
	PATH=$(abspath $(BIN)):$$PATH DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES= $(BIN)/python tests/numerics.py $(NUMERICS_ARGS)
	PATH=$(abspath $(BIN)):$$PATH DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES= $(BIN)/python tests/numerics.py --variants

# Mutation testing of the core modules against the in-process tests (settings: [tool.mutmut] in pyproject.toml).
# Not part of `make test`: it runs those tests once per mutant. Survivors: `$(BIN)/mutmut results`.
mutate: install-test
	$(BIN)/pip install -qq --disable-pip-version-check -e ".[mutate]" torch==2.13.0
	rm -rf mutants/.test-cache  # results stay: a stopped run resumes, changed code is mutated again
	$(RUN) MCIT_TEST_CACHE=$(abspath mutants/.test-cache) $(BIN)/mutmut run; $(BIN)/mutmut results

bench: data-cil data
	PATH=$(abspath $(BIN)):$$PATH DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES= $(BIN)/python bench/engine_throughput.py
	PATH=$(abspath $(BIN)):$$PATH DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES= $(BIN)/python bench/subspace_memory.py
	PATH=$(abspath $(BIN)):$$PATH DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES= $(BIN)/python bench/shard_read_speed.py
	$(RUN) $(BIN)/python bench/train_stage_throughput.py --epochs 10 --rounds 5
	$(RUN) $(BIN)/python bench/eval_throughput.py --rounds 5

clean:
	rm -rf runs

clean-data:
	rm -rf data/shards/digits data/shards/tiny_mcit data/backbones/tiny_vit_procedural \
	  data/backbones/tiny_clip_procedural data/backbones/tiny_llava
