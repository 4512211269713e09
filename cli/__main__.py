from cli.poolctl import main

main()
