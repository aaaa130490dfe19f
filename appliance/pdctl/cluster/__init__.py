"""A cluster: its description and the plan it implies (`description`), each host's part
(`render`, `compose`), the Helm chart's values (`helmvalues`), its status (`status`) and the
`--cluster` commands (`cmd`)."""
