"""Notebook mode for fastai v2: a notebook's learner fits on a persistent group of worker processes, one per device.

How one fit flows (each box a module of this package, or of ddipp.core.group)::

    notebook                                          worker process (one per rank: forked from the kernel's
    --------                                          fork server, or a fresh interpreter: core.group.forkserver)
                                                      ------------------------------------------------------
    learn.fit(...)  -> binding.fit_on_group -> core.group.binding.fit_on_group
                    -> fitting.fit_call   (the learner and the fit's callbacks as bytes: shipping; tensors
                                           the workers kept from the last fit, as digests)
                    -> core.group.WorkerGroup  ==socket==> core.group.worker.Worker (its command loop)
                                                           -> fitting.run_fit: learner.distribute(), learn.fit(...)
                                                              (core.group.fitting: what both adapters do around it;
                                                              core.state.full_state on every rank after it)
                       progress.ProgressMirror  <======= progress.ProgressRelay (rank 0's bars and table)
                       (prints)                 <======= core.group.output (rank 0's prints and warnings)
                       fitting.apply_results    <======= rank 0's weights, optimizer state, learner and callbacks

fit_one_cycle, fine_tune, fit_flat_cos and lr_find call `learn.fit`, so each of their fits runs on the group; what
they do around it (freezing, schedules, lr_find's suggestions and plot) runs in the notebook, as in plain fastai.
"""
