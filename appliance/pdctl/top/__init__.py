"""`pdctl top`: the live view of a proxy (`view`) and the command that shows it (`cmd`)."""
