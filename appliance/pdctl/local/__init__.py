"""`pdctl up --local`: the 1P1D node as local processes (`node`), and the state file that
finds them again for `down`, `status`, `logs` and `drain` (`state`)."""
