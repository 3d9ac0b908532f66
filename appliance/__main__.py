from appliance.cli import main

main()
