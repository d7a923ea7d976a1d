"""The floor every room may use: file primitives, bounded parsing, the error type, stop signals and their exit
codes, the plain progress line and the deadline clock. Nothing here imports torch or another room."""
