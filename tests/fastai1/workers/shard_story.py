"""to_ddp(shard=True) on fastai v1 beyond the split story: the story on the global batch, what a sharded fit holds on
a rank, what it leaves (SaveModelCallback's file written inside the fit, an export, a failed fit's start), a
distributed lr_find; played launched on 2 ranks (shard_worker.py) and in the tests' own process (the reference)."""
from fastai.basic_train import LearnerCallback
from fastai.callbacks import SaveModelCallback

from stories import held_bytes
from scenario import RaiseAt, digits_data, digits_learner, history, params, story, sweep, tabular_digits_learner


class HeldBytes(LearnerCallback):
    """The most bytes of parameters, gradients and optimizer state this rank held after a training step (a sharded
    tensor's own part)."""

    def on_train_begin(self, **kwargs):
        self.most = dict(params=0, grads=0, opt=0)

    def on_step_end(self, **kwargs):
        model, opt = self.learn.model, self.learn.opt.opt
        held = dict(params=held_bytes(model.parameters()), grads=held_bytes(p.grad for p in model.parameters()),
                    opt=held_bytes(v for state in opt.state.values() for v in state.values()))
        self.most = {k: max(v, held[k]) for k, v in self.most.items()}


def shard_story(make, path, bs: int) -> dict:
    """Each part on a new learner from `make(learner, **options)` (to_ddp(shard=True, ...), or nothing for the
    reference), batch `bs`."""
    res = {"story": story(make(digits_learner(digits_data(path / "story", bs=bs))))}
    learn = make(digits_learner(digits_data(path / "held", bs=bs)))
    learn.callback_fns.append(HeldBytes)
    learn.fit(1, 1e-3)
    res["held"] = dict(learn.held_bytes.most, params_after=held_bytes(learn.model.parameters()))
    learn = make(digits_learner(digits_data(path / "best", bs=bs)))
    learn.fit(3, 1e-2, callbacks=[SaveModelCallback(learn, name="best")])  # saves inside the fit, loads at its end
    res["best"] = dict(params=params(learn), history=history(learn))
    (path / "tabular").mkdir(parents=True, exist_ok=True)
    learn = make(tabular_digits_learner(path / "tabular"))
    learn.fit(1, 1e-2)
    learn.export("exported.pkl")
    res["exported"] = [t.detach().clone().float() for t in learn.model.state_dict().values()]
    learn = make(digits_learner(digits_data(path / "failed", bs=bs)))
    learn.fit(1, 1e-2)
    began, raised = params(learn), None
    learn.callback_fns.append(RaiseAt)
    try:
        learn.fit(1, 1e-2)
    except RuntimeError as e:
        raised = str(e)
    learn.callback_fns.pop()
    res["failed"] = dict(began=began, after=params(learn), raised=raised)
    res["sweep"] = sweep(make(digits_learner(digits_data(path / "sweep", bs=bs)), lr_find_mode="distributed"))
    return res
