from ballonet.cli import main

raise SystemExit(main())
