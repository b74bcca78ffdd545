"""The live side, in torch (never Lightning): probes of the gradients and activations, root cause
of a NaN, the preflight checks and the remedies."""
