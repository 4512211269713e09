from poold.cli import main

main()
