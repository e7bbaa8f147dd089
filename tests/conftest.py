"""Shared pytest options. Only `--update-golden` for now (see tests/test_golden.py)."""


def pytest_addoption(parser):
    parser.addoption(
        "--update-golden",
        action="store_true",
        default=False,
        help="rewrite tests/golden/<case>/expected/ from the current generator instead of "
        "comparing against it (review the result with `git diff tests/golden`)",
    )
