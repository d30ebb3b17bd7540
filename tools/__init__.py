"""The repository's tooling, not part of the package and not tests: `nbexport` (the notebooks' export and clean,
`make export` / `make notebooks`; the tests import it as `from tools import nbexport`) and `numeric_path` (the second
numeric path that `make test` runs nbval on)."""
