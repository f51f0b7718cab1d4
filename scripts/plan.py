"""Plan a run's parallel layout; the same program as `mjax-plan` (see mjax/plan/program.py for its flags)."""

from mjax.plan.program import entry

if __name__ == "__main__":
    entry()
