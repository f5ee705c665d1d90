// gradcomm: all-reduce for data-parallel training. The one header C++ users include.
#pragma once

#include "collectives/allgather.h"
#include "collectives/allreduce.h"
#include "collectives/broadcast.h"
#include "collectives/registry.h"
#include "core/communicator.h"
#include "core/config.h"
#include "core/data_type.h"
#include "core/error.h"
#include "core/half.h"
#include "core/reduce_op.h"
#include "gradcomm/config.h"
#include "packing/fusion_planner.h"
#include "packing/gradient_packer.h"
#include "packing/grouped_allreduce.h"
#include "packing/tensor.h"
#include "packing/workload.h"
