"""The command line: argument parsing, rendering and exit codes only."""
