"""The Redis Lua scripts, one file per atomic operation, shipped as package data.

This package holds no Python: it exists so `pip install .` installs the `.lua` files with the
code and `quotas.scripts` finds them through the import system (importlib.resources), wherever
the project is installed, instead of by path arithmetic from a module's file.
"""
