"""The programs: every command's arguments, set-up, teardown and exit codes (console scripts and pipelines/ shims)."""
