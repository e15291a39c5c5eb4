"""What a failed notebook fit leaves on the learner (ddipp.core.group.binding._failed): the newest of what rank 0 sent
back and the fit's Checkpoint file (ddipp.core.checkpoint.fit_checkpoint), without processes: the group and the
adapter's callables are stand-ins that record what was put on the learner."""
from ddipp.core.checkpoint import fit_checkpoint, write_checkpoint
from ddipp.core.group.binding import _failed

FIT = dict(run_id="run", fit=2)


class Group:
    """What _failed reads of a failed group: what rank 0 sent back (None: it died) and the rank that failed."""

    def __init__(self, trained):
        self.trained, self.failed_rank = trained, 1

    def say_kept(self, epoch, steps):
        print(f"kept rank 0's step {steps}")


def failed(tmp_path, capsys, trained=None, earlier=None, restarted=False, file_steps=None, fit=FIT):
    """_failed with rank 0's results given as their step counts, and a file of `fit` holding `file_steps` steps: what
    the learner was left with (the results' and the file's step counts in the order put) and the line said."""
    path, put = tmp_path / "models" / "kept.pth", []
    path.parent.mkdir(parents=True)
    if file_steps is not None:
        write_checkpoint(dict(model={}, opt={}, epoch=1, step=0, recorder=dict(losses=[0.0] * file_steps), **fit),
                         path, 1)

    def from_checkpoint(after):
        found = fit_checkpoint(path, 1, FIT, after)
        if found:
            put.append(("file", len(found[0]["recorder"]["losses"])))
        return found
    _failed(Group(trained), lambda results: put.append(("rank 0", results)), lambda: (1, put[-1][1]),
            lambda: put.append(("untrained", 0)), earlier, from_checkpoint, restarted)
    said = capsys.readouterr()
    return put, said.err + said.out


def test_rank0_alive_in_a_fit_not_restarted_keeps_its_state_and_never_reads_the_file(tmp_path, capsys):
    put, said = failed(tmp_path, capsys, trained=25, file_steps=40)  # a file rank 0 cannot have written: not read
    assert put == [("rank 0", 25)] and "kept rank 0's step 25" in said


def test_rank0_dead_keeps_the_fits_file_and_names_it(tmp_path, capsys):
    put, said = failed(tmp_path, capsys, file_steps=20)
    assert put == [("file", 20)]
    assert (f"the learner keeps the state of the fit's Checkpoint file {tmp_path / 'models' / 'kept.pth'}, written "
            "after epoch 1 (step 20 of the fit): rank 0 sent nothing back") in said


def test_an_earlier_fits_file_or_none_leaves_the_learner_as_it_was(tmp_path, capsys):
    put, said = failed(tmp_path, capsys, file_steps=20, fit=dict(FIT, fit=1))
    assert put == [("untrained", 0)] and "the learner here is as it was before it" in said
    put, said = failed(tmp_path / "none", capsys)
    assert put == [("untrained", 0)]


def test_after_a_restart_the_newer_of_rank0s_state_and_the_file_stays(tmp_path, capsys):
    put, said = failed(tmp_path / "a", capsys, earlier=4, restarted=True, file_steps=20)
    assert put == [("rank 0", 4), ("file", 20)] and "newer than what rank 0 trained before the restart (step 4)" in said
    put, said = failed(tmp_path / "b", capsys, trained=0, restarted=True, file_steps=20)  # died before it loaded it
    assert put == [("rank 0", 0), ("file", 20)] and "newer than what rank 0 trained (step 0)" in said
    put, said = failed(tmp_path / "c", capsys, earlier=30, restarted=True, file_steps=20)
    assert put == [("rank 0", 30)] and "what rank 0 trained before the restart, up to its last completed step" in said
    put, said = failed(tmp_path / "d", capsys, trained=25, restarted=True, file_steps=20)
    assert put == [("rank 0", 25)] and "kept rank 0's step 25" in said
