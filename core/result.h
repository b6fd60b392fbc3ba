// The core's view of the one error type: the public header (core/include/tensorhub/result.h,
// installed with libthclient) and the core's assertions.
#pragma once

#include "core/assert.h"
#include "tensorhub/result.h"
