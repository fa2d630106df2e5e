import pytest
from omegaconf import OmegaConf

from verl_replay.config import ReplayConfig, ReplayConfigError


def test_defaults_validate():
    config = ReplayConfig.from_mapping(None)
    assert config.strategy == "none"
    assert not config.uses_group_buffer and not config.uses_elite


def test_from_omegaconf_resolves_interpolations():
    node = OmegaConf.create({"root": "/x", "replay": {"strategy": "headroom_drift", "event_log": "${root}/e.jsonl"}})
    config = ReplayConfig.from_mapping(node.replay)
    assert config.event_log == "/x/e.jsonl"
    assert config.uses_headroom_drift and config.uses_group_buffer


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"strategy": "bogus"}, "replay.strategy"),
        ({"tau": -0.1}, "replay.tau"),
        ({"tau": float("nan")}, "replay.tau"),
        ({"tau": "small"}, "replay.tau"),
        ({"k_rep": 0}, "replay.k_rep"),
        ({"k_rep": 2.5}, "replay.k_rep"),
        ({"capacity": -3}, "replay.capacity"),
        ({"weighting": "abs"}, "replay.weighting"),
        ({"drift_norm": "linf"}, "replay.drift_norm"),
        ({"ingress": "all"}, "replay.ingress"),
        ({"scan_order": "newest"}, "replay.scan_order"),
        ({"scan_skip": "budget"}, "replay.scan_skip"),
        ({"scan_skip_margin": 0.5}, "replay.scan_skip_margin"),
        ({"scan_skip_margin": float("inf")}, "replay.scan_skip_margin"),
        ({"scan_skip_margin": "2"}, "replay.scan_skip_margin"),
        ({"scan_skip_versions": 0}, "replay.scan_skip_versions"),
        ({"scan_skip_growth": -0.5}, "replay.scan_skip_growth"),
        ({"scan_skip_growth": float("nan")}, "replay.scan_skip_growth"),
        ({"scan_skip_versions": 1.5}, "replay.scan_skip_versions"),
        ({"scan_chunk_groups": 0}, "replay.scan_chunk_groups"),
        ({"max_scan_groups": 0}, "replay.max_scan_groups"),
        ({"k_rep": 10, "capacity": 5, "strategy": "naive"}, "replay.k_rep"),
        ({"elite": {"mu": 1.5}}, "replay.elite.mu"),
        ({"elite": {"batch_size": 0}}, "replay.elite.batch_size"),
        ({"strategy": "elite"}, "replay.elite.archive"),
        ({"typo_key": 1}, "replay.typo_key"),
        ({"elite": {"archve": "x"}}, "replay.elite.archve"),
    ],
)
def test_invalid_values_name_the_key(raw, key):
    with pytest.raises(ReplayConfigError, match=key.replace(".", r"\.")):
        ReplayConfig.from_mapping(raw)


def test_scan_skip_and_mean_sq_settings():
    cfg = ReplayConfig.from_mapping(
        {"drift_norm": "mean_sq", "tau": 1e-3, "scan_skip": "cooldown", "scan_skip_versions": None}
    )
    assert (cfg.drift_norm, cfg.scan_skip, cfg.scan_skip_versions) == ("mean_sq", "cooldown", None)
    assert ReplayConfig().scan_skip == "none"  # the paper's scan by default


def test_elite_strategies_and_sampler_kind():
    config = ReplayConfig.from_mapping({"strategy": "elite_iid", "elite": {"archive": "a.parquet"}})
    assert config.uses_elite and config.elite_sampler == "iid" and not config.uses_group_buffer
    combined = ReplayConfig.from_mapping({"strategy": "headroom_drift+elite", "elite": {"archive": "a.parquet"}})
    assert combined.uses_elite and combined.uses_headroom_drift and combined.elite_sampler == "balanced"


@pytest.mark.parametrize(
    "override, message",
    [
        ("replay.k_repp=2", r"replay\.k_repp \(did you mean replay\.k_rep\?\)"),
        ("+replay.k_repp=2", r"replay\.k_repp \(did you mean replay\.k_rep\?\)"),
        ("++replay.tua=0.1", r"replay\.tua \(did you mean replay\.tau\?\)"),
        ("replay.elite.archve=a.parquet", r"replay\.elite\.archve \(did you mean replay\.elite\.archive\?\)"),
        ("~replay.strategi", r"replay\.strategi \(did you mean replay\.strategy\?\)"),
        (
            "replay.zzzz=1",
            r"unknown setting\(s\) replay\.zzzz; valid keys under replay are: allow_missing_state, audit_dir, ",
        ),
    ],
)
def test_unknown_override_keys_get_a_did_you_mean(override, message):
    from verl_replay.config import check_override_keys

    with pytest.raises(ReplayConfigError, match=message):
        check_override_keys(["trainer.total_training_steps=2", override])


def test_known_override_keys_and_other_sections_pass():
    from verl_replay.config import check_override_keys

    check_override_keys(
        [
            "replay.k_rep=2",
            "+replay.tau=0.1",
            "replay.elite.mu=0.1",
            "~replay.max_scan_groups",
            "replay.elite={archive:a.parquet}",
            "replay_extra.x=1",
            "trainer.replay.x=1",
            "--cfg",
            "job",
        ]
    )


def test_unknown_mapping_key_gets_a_did_you_mean():
    with pytest.raises(ReplayConfigError, match=r"replay\.capacty \(did you mean replay\.capacity\?\)"):
        ReplayConfig.from_mapping({"capacty": 8})
