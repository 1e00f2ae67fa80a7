"""The trainer's flags, the typed configuration built from them, and the check of a job's command line
that launchers run before anything starts (no torch).
"""
