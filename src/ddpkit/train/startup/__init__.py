"""A process's start: how it was launched, its flags and environment, the network checks before it
joins, the process group, and the rank report every job opens with.
"""
