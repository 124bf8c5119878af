"""The coordinator's request wave (`launch/coordinator/waves.py`), as pure logic:
each event against the state it must leave, and the invariants its docstring names
(waves only move forward; the leader alone reports completion)."""

from __future__ import annotations

from dpserve.launch.coordinator.waves import Waves
from dpserve.protocol import StartDPWave, WakeEngines


def test_a_wake_starts_the_paused_wave_once_skipping_the_engine_that_has_it():
    waves = Waves()
    assert waves.on_wake(WakeEngines(wave=0, engine_index=1)) == StartDPWave(0, 1)
    assert waves.running
    assert waves.on_wake(WakeEngines(wave=0, engine_index=0)) is None  # already running


def test_a_stale_wake_starts_the_wave_on_every_engine():
    waves = Waves()
    assert waves.on_wave_complete(0, 0, leader=0)  # wave 0 ended: wave 1, paused
    # The front-end stamped wave 0 on its request: engine 1 must hear the start too.
    assert waves.on_wake(WakeEngines(wave=0, engine_index=1)) == StartDPWave(1, None)


def test_only_the_leader_reports_wave_completion():
    waves = Waves()
    waves.on_wake(WakeEngines(wave=0))
    assert not waves.on_wave_complete(1, 0, leader=0)
    assert (waves.wave, waves.running) == (0, True)
    assert waves.on_wave_complete(0, 0, leader=0)
    assert (waves.wave, waves.running) == (1, False)


def test_waves_only_move_forward():
    waves = Waves()
    waves.on_wave_complete(0, 2, leader=0)
    assert (waves.wave, waves.running) == (3, False)
    assert not waves.on_wave_complete(0, 1, leader=0)  # late news of an older wave
    assert waves.on_start_wave(1, 2) is None  # a start of a finished wave
    assert waves.wave == 3
    assert waves.on_start_wave(1, 3) == StartDPWave(3, exclude_engine_index=1)
    assert waves.on_start_wave(0, 3) is None  # the current wave runs already
    waves.publish()
    assert waves.published == 3


def test_scaling_up_leaves_the_state_paused_so_the_next_request_wakes_all():
    waves = Waves()
    waves.on_wake(WakeEngines(wave=0, engine_index=0))
    waves.scaled_up()
    assert not waves.running
    assert waves.on_wake(WakeEngines(wave=0, engine_index=0)) == StartDPWave(0, 0)
