"""Everything is declared in pyproject.toml; this file only lets older tools call `setup.py`."""

from setuptools import setup

setup()
