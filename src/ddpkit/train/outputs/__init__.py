"""What the job shows and writes: the progress bar and log lines, TensorBoard scalars, and every rank's
step times for the report.
"""
