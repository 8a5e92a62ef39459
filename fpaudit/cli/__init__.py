"""The command line: options, config files, rendering (terminal, JUnit/GitHub, images); the
only room that loads typer or rich.
"""
