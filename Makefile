# accel-course: `make course` runs the whole course and writes build/report.html; `make test` runs every test.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
SITE   := .venv-site
NBS    := $(sort $(wildcard notebooks/[0-9][0-9]_*.ipynb))
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# pip install, tried up to three times: a download cut off mid-wheel (urllib3's read error, which pip's own --retries
# does not cover) is the registry's hiccup; a real conflict fails all three times. $(call PIP,python,arguments)
PIP = for i in 1 2 3; do $(1) -m pip install -q $(2) && break; \
	if [ $$i = 3 ]; then echo "pip failed 3 times (see its message above)"; exit 1; fi; \
	echo "pip failed (attempt $$i of 3); trying again in 10 s"; sleep 10; done

.PHONY: venv course smoke test test-fast test-compat test-colab device-check lab notebooks bench lint clean export \
	browser slurm venv-edge links site test-site

venv: $(STAMP)

# Re-installs only when the pins or the package metadata change.
$(STAMP): requirements.txt pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(call PIP,$(BIN)/python,-r requirements.txt)
	@touch $(STAMP)

course: venv
	$(BIN)/python -m accelhelpers course run --profile quick

# Two pytest-xdist workers, one test file (or notebook) each at a time: the file's module fixtures and a notebook's
# cells stay together; the longest files go first (tests/conftest.py: COST; --no-loadscope-reorder keeps that
# order), so the short ones fill the end. Two workers share two cores: each worker's torch gets one thread
# (OMP_NUM_THREADS=1, one core each; a cell or test that is about threads sets its own count), and OpenMP's threads
# sleep instead of spinning while they wait (OMP_WAIT_POLICY=PASSIVE: about 2.7x the throughput of two busy-waiting
# processes here). Timing tests compare within one process, so they hold under the load; the chapters' own figures
# come from `make course`. The 25 slowest tests' times end the output (the CI log's record of where the time went).
# Inductor takes the CPU's vector instructions from its flags (TORCHINDUCTOR_VEC_ISA_OK=1), as every chapter's setup
# tells it to (ah.session.trust_cpu_flags), so the tests' own processes skip its per-process check too.
# Everything runs on a second numeric path of this CPU (tools/numeric_path.py: vector kernels one level below its
# own, MKL held to AVX2, checked first to change a training run's bits here), so nbval shows that the compared
# outputs hold on another CPU, not only on the kind that recorded them. Where no second path exists (it would not
# change the bits), the tests run on this CPU's own kernels and say so; ACCEL_REQUIRE_SECOND_PATH=1 (CI) fails instead.
test: venv lint browser slurm $(SITE)/.installed
	@path=$$($(BIN)/python tools/numeric_path.py) || { \
		if [ -n "$$ACCEL_REQUIRE_SECOND_PATH" ]; then echo "no second numeric path on this CPU"; exit 1; fi; \
		echo "no second numeric path on this CPU: nbval compares on its own kernels"; path=""; }; \
	echo "numeric path of the tests: $${path:-this CPU's own}"; \
	env $$path OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE TORCHINDUCTOR_VEC_ISA_OK=1 $(BIN)/python -m pytest \
		tests notebooks --nbval -n 2 \
		--dist loadfile --no-loadscope-reorder --durations=25

# The edit-test loop (under 3 minutes on 2 cores): the package's tests without the slow ones (tests/conftest.py marks
# them: notebooks, other processes, seconds of training). `make test` runs everything, these included.
test-fast: venv
	TQDM_DISABLE=1 $(BIN)/python -m pytest tests -m "not slow" -q -p no:cacheprovider

# The package's fast tier against the newer torch of requirements-compat.txt, in .venv-compat, without torch_xla:
# what only a newer torch can break in the helpers (Colab ships a newer torch than our pins). The chapters under a
# newer torch run in test-colab (Colab's GPU image: torch 2.11), so the slow tier is not repeated here.
COMPAT := .venv-compat
$(COMPAT)/.installed: requirements.txt requirements-compat.txt pyproject.toml
	@test -x $(COMPAT)/bin/python || $(PYTHON) -m venv $(COMPAT)
	@mkdir -p build
	grep -vE '^(torch|torchvision|torch-xla|playwright)==' requirements.txt > build/requirements-compat-rest.txt
	@$(call PIP,$(COMPAT)/bin/python,-r requirements-compat.txt -r build/requirements-compat-rest.txt)
	@touch $@

test-compat: $(COMPAT)/.installed
	ACCEL_PROFILE=quick ACCEL_COMPAT=1 TQDM_DISABLE=1 $(COMPAT)/bin/python -m pytest tests -m "not slow" -q \
		-p no:cacheprovider --ignore=tests/test_browser.py

# The course under Colab's own package sets (tests/colab/: the GPU and the TPU image), installed the way the
# chapters' setup cells install it, every chapter executed top to bottom (quick profile, CPU; XLA's CPU device).
# The TPU image ships the GPU image's packages but for torch 2.9.0 (our pin, which nbval runs), torch_xla, protobuf 7
# and pillow 12: it runs the chapters those reach (01's setup and device report, 05's images, 07's XLA, 08 and 10's
# ONNX); every chapter runs under the GPU image's newer torch.
TPU_IMAGE_CHAPTERS := 01,05,07,08,10
test-colab: venv
	$(BIN)/python tests/colab/check.py gpu
	$(BIN)/python tests/colab/check.py tpu --only $(TPU_IMAGE_CHAPTERS)

# Every chapter's full-smoke run with this checkout's packages: the full profile's code paths, a few steps of each
# (CONTRIBUTING.md: make smoke). test-colab runs the same under Colab's GPU package set.
smoke: venv slurm
	TQDM_DISABLE=1 $(BIN)/python -m accelhelpers course run --profile smoke --out build/smoke --no-report

# One command for an accelerator machine (<= 8 min on a GPU): hardware report, bench fullbatch and every chapter
# that can use the accelerator, recorded under results/device-check_<hardware>_<date>/. CI runs it on the CPU
# without recording (DEVICE_CHECK_FLAGS=).
DEVICE_CHECK_FLAGS ?= --record
device-check: venv
	$(BIN)/python -m accelhelpers course device-check $(DEVICE_CHECK_FLAGS)

# Headless Chromium for tests/test_browser.py: Debian's package (never a browser download). Installed when
# missing and we are root with apt-get (as in CI); elsewhere a note, and the browser tests skip.
browser:
	@if [ -n "$$ACCEL_CHROMIUM" ] || command -v chromium >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Debian's chromium for the browser tests"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -qq chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium; } \
		|| { echo "apt-get install chromium failed: install it, or set ACCEL_CHROMIUM to a Chromium"; exit 1; }; \
	else echo "Chromium not found: install it (Debian/Ubuntu: apt-get install chromium) or set ACCEL_CHROMIUM;" \
		"the browser tests will be skipped"; fi

# A real Slurm for chapter 12 and tests/test_slurm.py: Debian's slurm-wlm and munge, installed when missing and we
# are root with apt-get (as in CI); ah.slurm starts a one-node cluster from them. Elsewhere a note, and those skip.
slurm:
	@if command -v slurmctld >/dev/null 2>&1 && command -v munged >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Debian's slurm-wlm and munge for chapter 12"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -qq slurm-wlm munge >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq slurm-wlm munge; } \
		|| { echo "apt-get install slurm-wlm munge failed: install them to run chapter 12's jobs"; exit 1; }; \
	else echo "Slurm not found: as root on Debian/Ubuntu, apt-get install slurm-wlm munge; chapter 12 explains" \
		"itself and its Slurm tests skip"; fi

# The lessons live in the notebooks: `#| export` cells go into accelhelpers/ (nbdev 3). After editing an exported
# cell, `make export` (or `make export NB=notebooks/03_momentum_adam_one_cycle.ipynb` for one chapter).
export: venv
	$(BIN)/python tools/nbexport.py $(NB)

# The Colab badges and setup cells, written from pyproject.toml's [project.urls] Repository and the version (CONTRIBUTING.md:
# Publishing); tests/test_colab.py fails when they disagree.
links: venv
	$(BIN)/python -m accelhelpers course links

lab: venv
	$(BIN)/jupyter lab notebooks

notebooks: venv
	@for nb in $(NBS); do echo "executing $$nb"; \
		ACCEL_PROFILE=quick TQDM_DISABLE=1 $(BIN)/jupyter nbconvert --to notebook --execute --inplace \
		--ExecutePreprocessor.timeout=600 --KernelManager.transport_encryption=required "$$nb" || exit 1; \
		$(BIN)/python tools/nbexport.py --clean "$$nb"; done

bench: venv
	$(BIN)/python -m accelhelpers bench fullbatch --json build/bench_fullbatch.json

# ruff's rules over the package, the tests, the tooling and the notebooks; and the notebooks' code cells as
# `ruff format` writes them (`.venv/bin/ruff format notebooks`, then `make export`; a %%writefile cell stays as
# written).
lint: venv
	$(BIN)/ruff check accelhelpers tests tools notebooks
	$(BIN)/ruff format --check notebooks

clean:
	rm -rf build

# Chapter 10's LiteRT converter (litert-torch) cannot share .venv: it pins typing_extensions and pydantic below
# the course's and needs torchao >= 0.17 (0.17.0 is the newest that imports with torch 2.9). .venv-edge layers it
# over .venv: a .pth file adds .venv's packages (torch included, never downloaded twice) behind its own.
EDGE := .venv-edge
venv-edge: $(EDGE)/.installed

$(EDGE)/.installed: $(STAMP)
	@test -x $(EDGE)/bin/python || $(BIN)/python -m venv $(EDGE)
	@echo "import site; site.addsitedir('$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')')" \
		> "$$($(EDGE)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_accel_course_venv.pth"
	@$(call PIP,$(EDGE)/bin/python,"litert-torch==0.10.0" "torchao==0.17.0")
	@touch $@

# The course as a website in build/site/ (docs/site.md): every chapter with its stored outputs (never executed),
# the guides, the recorded results and reports; sidebar navigation and an offline search. tools/website.py stages
# the pages and runs Sphinx with MyST-NB and the book theme (Jupyter Book's engine; docs/conf.py), from .venv-site:
# the pins of requirements-site.txt layered over .venv as .venv-edge is. Serve it with
# `python3 -m http.server -d build/site`. test-site opens every page of that build in headless Chromium
# (tests/test_site.py); `make test` installs .venv-site and its test_site builds a site of its own and opens every
# page (so CI builds and tests the site inside `make test`).
$(SITE)/.installed: $(STAMP) requirements-site.txt
	@test -x $(SITE)/bin/python || $(BIN)/python -m venv $(SITE)
	@echo "import site; site.addsitedir('$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')')" \
		> "$$($(SITE)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_accel_course_venv.pth"
	@$(call PIP,$(SITE)/bin/python,-r requirements-site.txt)
	@touch $@

site: $(SITE)/.installed
	$(SITE)/bin/python tools/website.py build/site

test-site: site browser
	ACCEL_SITE_DIR=build/site $(BIN)/python -m pytest tests/test_site.py -q -p no:cacheprovider --durations=5
