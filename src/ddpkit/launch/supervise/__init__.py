"""Supervision of the nodes a launcher starts: node output and its dedup, the supervisor's state per
node, recovery after a lost node, stragglers named, Ctrl-C, process trees.
"""
