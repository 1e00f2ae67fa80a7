"""The trainer's watchdog: heartbeats and the stall judge, stragglers from each rank's own work, and a
lost node noticed by its silence.
"""
