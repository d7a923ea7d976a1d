"""Recipe changes in a run's history: only the kept sessions' changes, each from its session's first
update."""

from pilotrun.run.changes import RecipeChange, recipe_changes_in_history


def run_with_changes():
    return {
        "sessions": [{"session_id": "s1", "start_step": 0}, {"session_id": "s2", "start_step": 120},
                     {"session_id": "s3", "start_step": 80}],
        "allowed_changes": [
            {"session_id": "s2", "key": "optim.muon.lr", "old": 0.02, "new": 0.01},
            {"session_id": "s3", "key": "train.max_steps", "old": 240, "new": 400},
            {"session_id": "s9", "key": "train.seed", "old": 0, "new": 1},  # a session run.json does not list
        ],
    }


def test_changes_of_the_kept_lineage_take_effect_from_the_next_update():
    changes = recipe_changes_in_history(run_with_changes(), ["s1", "s2", "s3"])
    assert changes == [RecipeChange("optim.muon.lr", 0.02, 0.01, "s2", 121),
                       RecipeChange("train.max_steps", 240, 400, "s3", 81)]


def test_a_session_outside_the_kept_history_contributes_no_change():
    # s2 was rolled back (s3 resumed from an earlier checkpoint): its change is not in force.
    changes = recipe_changes_in_history(run_with_changes(), ["s1", "s3"])
    assert [c.key for c in changes] == ["train.max_steps"]
    assert recipe_changes_in_history({"sessions": []}, []) == []


def test_a_change_describes_itself_in_one_short_line():
    change = RecipeChange("data.path", "x" * 100, "y", "s2", 7)
    line = change.describe()
    assert line.startswith("data.path ") and line.endswith(" -> y from update 7")
    assert "x" * 57 + "..." in line and "x" * 58 not in line
