from tfcli.cli import main

main()
