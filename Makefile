# accel-course: `make course` runs the whole course and writes build/report.html; `make test` runs every test.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
NBS    := $(sort $(wildcard notebooks/[0-9][0-9]_*.ipynb))
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: venv course test lab notebooks bench lint clean

venv: $(STAMP)

# Re-installs only when the pins or the package metadata change.
$(STAMP): requirements.txt pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -r requirements.txt
	@touch $(STAMP)

course: venv
	$(BIN)/python -m accelhelpers course run --profile quick

test: venv lint
	ACCEL_PROFILE=quick $(BIN)/python -m pytest tests notebooks --nbval --nbval-current-env \
		--nbval-sanitize-with tests/nbval_sanitize.cfg

lab: venv
	$(BIN)/jupyter lab notebooks

notebooks: venv
	@for nb in $(NBS); do echo "executing $$nb"; \
		ACCEL_PROFILE=quick $(BIN)/jupyter nbconvert --to notebook --execute --inplace \
		--ExecutePreprocessor.timeout=600 "$$nb" || exit 1; done

bench: venv
	$(BIN)/python -m accelhelpers bench fullbatch --json build/bench_fullbatch.json

lint: venv
	$(BIN)/ruff check accelhelpers tests notebooks

clean:
	rm -rf build
