"""`python -m appliance.pdctl ...` is `pdctl ...`."""

from appliance.pdctl.cli import main

main()
