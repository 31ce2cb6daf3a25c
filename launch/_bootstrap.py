"""Imported first by every launcher.

``launch/pretrain.py`` is named like the package it imports, and Python puts the script's folder
first on ``sys.path``: take that folder off so ``import pretrain`` finds the package, and put the
repository root first so a fresh clone runs without being installed too.
"""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))
