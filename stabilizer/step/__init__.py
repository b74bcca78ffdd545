"""The step: measure, decide inside ``optimizer.step``, check, account, report — for every host.

Torch only, never Lightning. A host (`stabilizer.step.host.Host`: Lightning's ``Trainer`` in
``stabilizer.callbacks``, a plain loop or Fabric in `stabilizer.hosts.loop`, the Hugging Face
``Trainer`` in `stabilizer.hosts.hf`) builds a `stabilizer.step.monitor.RunMonitor` and calls it
at the moments of each batch. Policies are objects (`stabilizer.step.policies`).
"""
