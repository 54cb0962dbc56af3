//go:build tools

// Package tools only names the Dapr commands this module builds, so `go mod tidy` keeps
// their dependencies in go.mod and go.sum.
package tools

import (
	_ "github.com/dapr/dapr/cmd/daprd"
	_ "github.com/dapr/dapr/cmd/placement"
)
