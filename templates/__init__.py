"""The console's Django templates (templates/console/), shipped as package data.

A package only so `pip install .` installs the templates with the code; config/settings.py finds
the directory through the import system, wherever the project is installed.
"""
