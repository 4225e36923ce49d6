module local/triptych/pause

go 1.24.0
