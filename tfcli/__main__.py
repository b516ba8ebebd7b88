from tfcli._entry import main

main()
