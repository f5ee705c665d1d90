#include <mpi.h>
#include <cstdio>
#include <vector>
#include <algorithm>
int main(int argc,char**argv){MPI_Init(&argc,&argv);int me,n;MPI_Comm_rank(MPI_COMM_WORLD,&me);MPI_Comm_size(MPI_COMM_WORLD,&n);
MPI_Comm dup;MPI_Comm_dup(MPI_COMM_WORLD,&dup);
for(size_t bytes: {1u<<20, 4u<<20, 16u<<20}){
 size_t count=bytes/4/n; std::vector<float> send(count,1.f), recv(count*n);
 std::vector<double> t[4];
 for(int r=0;r<21;r++) for(int v0=0;v0<4;v0++){int v=(v0+r)%4;
  MPI_Barrier(MPI_COMM_WORLD); double s=MPI_Wtime();
  for(int c=0;c<3;c++){
   MPI_Comm cm = (v&1)?dup:MPI_COMM_WORLD;
   if(v&2) MPI_Allgather(send.data(),count*4,MPI_BYTE,recv.data(),count*4,MPI_BYTE,cm);
   else MPI_Allgather(send.data(),count,MPI_FLOAT,recv.data(),count,MPI_FLOAT,cm);}
  double e=(MPI_Wtime()-s)/3; double m; MPI_Allreduce(&e,&m,1,MPI_DOUBLE,MPI_MAX,MPI_COMM_WORLD); t[v].push_back(m*1e6);}
 if(me==0){printf("%9zu",bytes); for(auto&x:t){std::sort(x.begin(),x.end());printf(" %9.1f",x[x.size()/2]);} printf("   (float/world float/dup byte/world byte/dup)\n");}
}
MPI_Finalize();}
