"""Generation limits follow the task tier unless set (`sampler.max_new_tokens = "auto"`)."""

from __future__ import annotations

import pytest

from threepo.deploy.config import load_config, to_toml
from threepo.services.tasks.synthetic import expected_completion, generate_items, max_new_tokens_for

TIERS = [("arith", 1), ("arith", 2), ("arith", 3), ("countdown", 1), ("countdown", 2),
         ("code", 1), ("code", 2), ("code", 3)]


@pytest.mark.parametrize("family,difficulty", TIERS)
def test_the_limit_fits_every_reference_completion_with_room(family, difficulty):
    limit = max_new_tokens_for(family, difficulty)
    # items the limit was not measured on (another seed, both splits); +1 for EOS, one token a char
    items = [*generate_items(family, "train", 500, seed=7, difficulty=difficulty),
             *generate_items(family, "heldout", 200, seed=7, difficulty=difficulty)]
    longest = max(len(expected_completion(item)) for item in items)
    assert longest + 1 < limit and limit % 8 == 0 and limit >= 16


def test_run_config_resolves_the_limit_from_the_task_unless_set(tmp_path):
    assert load_config(None, []).sampler.max_new_tokens == 16  # arith: as before
    countdown = load_config(None, ["task.family=countdown", "task.difficulty=1"])
    assert countdown.sampler.max_new_tokens == 24  # the bootstrap's eval limit for this tier
    assert load_config(None, ["task.family=countdown", "sampler.max_new_tokens=16"]).sampler.max_new_tokens == 16
    recipe = tmp_path / "resolved.toml"
    recipe.write_text(to_toml(countdown))  # the run directory records the resolved number
    assert load_config(str(recipe)).sampler.max_new_tokens == 24


def test_the_hard_countdown_recipe_starts_low_and_samples_with_its_tier_limit():
    cfg = load_config("countdown_hard")
    assert (cfg.task.family, cfg.task.difficulty, cfg.bootstrap.target_pass1) == ("countdown", 2, 0.05)
    assert cfg.sampler.max_new_tokens == 32
