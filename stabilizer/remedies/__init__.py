"""`stabilizer.remedies`: the public name of `stabilizer.live.remedies` (plain functions on a model
and optimizer, usable without Lightning)."""

from stabilizer.live.remedies import *  # noqa: F403
from stabilizer.live.remedies import __all__ as __all__
