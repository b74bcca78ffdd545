"""The replay side: log readers, the diagnosis of a finished run, and its bounded history.

No torch: `stabilizer diagnose` reads any run's log without it.
"""
