"""Adapters that run quantkit's kernels inside other inference engines.

Each module here imports its engine and is loaded by that engine (through an entry point), never by
``import quantkit``: quantkit itself does not need any engine installed.
"""
