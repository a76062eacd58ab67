"""Simulated engines (issue #38): the real scheduler, block manager, prefix cache, KV
connector and HTTP server around a forward that sleeps a predicted step time.

hardware.py  step-time models (calibrated on a machine, or derived for an accelerator and a
             model shape), KV links, profile files; torch-free
engine.py    SimulatedEngine: an EngineLoop whose forward is a sleep and deterministic tokens
profile.py   `atomd profile`: times the real engine's steps and fits a calibrated profile
fleet.py     a fleet of real Schedulers in virtual time (what `atomd plan` simulates)
plan.py      `atomd plan`: xPyD layouts by simulated goodput per accelerator, Ray / Helm output
"""
