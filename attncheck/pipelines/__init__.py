"""Library entry points, one per command: files or a config in, results out.

The CLI only parses options, calls these, renders the results and maps errors to
exit codes; scripts and notebooks can call them the same way.
"""
