module gemmalab.local/pause

go 1.26.0
