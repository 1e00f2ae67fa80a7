"""Render primitives under every target: one Jinja environment, its filters and
post-render checks (engine), every escaping rule for text written for another
program (quoting), where the shipped templates are found (templatedir).
Which files a target renders lives in ddpkit.targets, which imports this package."""
