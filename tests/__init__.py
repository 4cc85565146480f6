"""The test suite (a package so that `tests.helpers` imports the same way from pytest, spawned workers and
scripts: the repo root on sys.path is all any of them needs). Map: tests/README.md."""
