"""`ddpkit report`: a run's metrics and events as one self-contained HTML
page with PNGs beside it (docs/guides/runs.md). data reads the run folder and the
metrics records, plots draws the figures (matplotlib, Agg), page writes the
HTML, command is the CLI."""
