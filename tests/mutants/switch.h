// The switch of the mutant schemata (tests/mutants/mutate.py): which planted bug, if any, this
// process runs. Only the mutant builds of core include it; shipped code never does.
#pragma once

// True when the environment variable TH_MUTANT names mutant `id` (read once per process).
bool th_mutant_on(int id);
